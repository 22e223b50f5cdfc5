"""Request body -> ChatRequest or CompletionRequest, or a 400 naming the field that is wrong.

Types are checked strictly (a bool is not a number, a string is not a list);
unknown fields are ignored, as OpenAI clients send many we do not use.
"""
import math
import re
from dataclasses import dataclass, field

import orjson

from tornchat import reasoning
from tornchat.engine import processors
from tornchat.engine.grammar import schema_error
from tornchat.engine.types import SamplingParams
from tornchat.functions import Choice, Format
from tornchat.server.errors import invalid

ROLES = ("system", "developer", "user", "assistant", "function", "tool")  # developer: newer clients' system
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is a generation of its own, queued behind the running ones
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SEED_MODULUS = 1 << 63  # seeds of any size map into the sampler's int64 range
EFFORTS = ("none", "minimal", "low", "medium", "high")  # reasoning_effort: "none" turns thinking off, the rest on
# Names chat_template_kwargs may not set: the variables prompt.render sets itself, and the rest of transformers'
# apply_chat_template arguments, which a client could expect to act as such rather than reach the template.
TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


@dataclass
class Request:
    """What both endpoints take."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1  # choices, each its own generation of the one prompt
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: not asked; n: with the n most likely tokens at each position
    prediction: str = ""  # Predicted Outputs: text the reply is expected to repeat, drafted from


@dataclass
class ChatRequest(Request):
    messages: list[dict] = field(default_factory=list)  # role, content (str), and function_call / tool_calls / name / tool_call_id if present
    max_length: int | None = None
    functions: list[dict] = field(default_factory=list)  # name, description, parameters
    call_style: str | None = None  # "functions" (legacy) or "tools": the shape of a call in the reply
    choice: Choice = field(default_factory=Choice)
    response_format: Format = field(default_factory=Format)
    thinking: reasoning.Asked = field(default_factory=reasoning.Asked)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, enable_thinking aside (reasoning has it)


@dataclass
class CompletionRequest(Request):
    prompt: str | list[int] = ""  # text, or token ids


def parse_body(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise invalid("body must be a JSON object")
    return data


def chat_request(data: dict, max_messages: int, vocab_size: int) -> ChatRequest:
    functions, call_style, choice = _functions(data)
    max_tokens = [v for v in (_integer(data, "max_tokens", 1), _integer(data, "max_completion_tokens", 1)) if v]
    logprobs = _boolean(data, "logprobs")
    top_logprobs = _integer(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid("top_logprobs needs logprobs: true")
    thinking, template_kwargs = _reasoning(data)
    return ChatRequest(
        **_shared(data, vocab_size),
        max_tokens=min(max_tokens, default=None),
        logprobs=(top_logprobs or 0) if logprobs else None,
        messages=_messages(data.get("messages"), max_messages),
        max_length=_integer(data, "max_length", 1),
        functions=functions,
        call_style=call_style,
        choice=choice,
        response_format=_response_format(data.get("response_format")),
        thinking=thinking,
        template_kwargs=template_kwargs,
    )


def completion_request(data: dict, vocab_size: int) -> CompletionRequest:
    """POST /v1/completions: one prompt, n choices of the generated text only."""
    if _boolean(data, "echo"):
        raise invalid("echo must be false: the reply holds the generated text only")
    if _string(data, "suffix", "suffix"):
        raise invalid("suffix is not supported")
    if _integer(data, "best_of", 1) not in (None, 1):
        raise invalid("best_of must be 1: candidates are not ranked (n gives several choices)")
    max_tokens = _integer(data, "max_tokens", 1)
    return CompletionRequest(
        **_shared(data, vocab_size),
        max_tokens=COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=_integer(data, "logprobs", 0, MAX_TOP_LOGPROBS),
        prompt=_prompt(data.get("prompt"), vocab_size),
    )


def _shared(data: dict, vocab_size: int) -> dict:
    """The fields both endpoints read the same way, as keyword arguments of Request."""
    model = data.get("model")
    if not isinstance(model, str):
        raise invalid("model is required and must be a string")
    stream_options = _object(data, "stream_options")
    return {
        "sampling": _sampling(data, vocab_size),
        "stop": _stop(data.get("stop")),
        "n": _integer(data, "n", 1, MAX_CHOICES) or 1,
        "stream": bool(_boolean(data, "stream")),
        "include_usage": bool(_boolean(stream_options, "include_usage", "stream_options.include_usage")),
        "prediction": _prediction(data.get("prediction")),
    }


def _sampling(data: dict, vocab_size: int) -> SamplingParams:
    def number(key: str, low: float, high: float, default: float) -> float:
        value = _number(data, key, low, high)
        return default if value is None else value

    seed = _integer(data, "seed", None)
    options = {}
    for processor in processors.PROCESSORS:
        for option in processor.fields:
            value = _option(data, option, vocab_size)
            if value is not None and value != option.neutral:
                options[option.name] = value
    return SamplingParams(
        temperature=number("temperature", 0.0, 2.0, 1.0),
        top_k=_integer(data, "top_k", 1) or 0,
        top_p=number("top_p", 0.0, 1.0, 1.0),
        seed=None if seed is None else seed % SEED_MODULUS,
        options=options,
    )


def _option(data: dict, option: processors.Field, vocab_size: int):
    """A logits processor's field, checked by its declared kind and range; None where not given."""
    if option.kind == processors.NUMBER:
        value = _number(data, option.name, option.low, option.high)
        if value == option.low and option.above_low:
            raise invalid(f"{option.name} must be above {option.low:g}")
        return value
    if option.kind == processors.INTEGER:
        return _integer(data, option.name, option.low, option.high)
    if option.kind == processors.STRINGS:
        return _strings(data, option)
    return _logit_bias(data, option, vocab_size)


def _reasoning(data: dict) -> tuple[reasoning.Asked, dict]:
    """reasoning_effort, reasoning_budget and chat_template_kwargs (whose enable_thinking is the same switch)."""
    kwargs = _object(data, "chat_template_kwargs")
    for key in kwargs:
        if key in TEMPLATE_ARGUMENTS:
            raise invalid(f"chat_template_kwargs.{key} cannot be set: the server passes it to the template itself")
    switch = _boolean(kwargs, reasoning.SWITCH, f"chat_template_kwargs.{reasoning.SWITCH}")
    enabled = effort_enables(data.get("reasoning_effort"), "reasoning_effort")
    if switch is not None and enabled is not None and switch != enabled:
        raise invalid(f"reasoning_effort and chat_template_kwargs.{reasoning.SWITCH} disagree: give one of them")
    budget = _integer(data, "reasoning_budget", 0)
    rest = {key: value for key, value in kwargs.items() if key != reasoning.SWITCH}
    return reasoning.Asked(switch if switch is not None else enabled, budget), rest


def effort_enables(value, name: str) -> bool | None:
    """Whether a reasoning effort turns thinking on ("none": off), None where none is given."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise invalid(f"{name} must be one of {', '.join(EFFORTS)}")
    return value != "none"


# ---- scalar fields ----------------------------------------------------------------


def _number(data: dict, key: str, low: float, high: float, name: str | None = None) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name or key} must be a number")
    if not low <= value <= high:
        raise invalid(f"{name or key} must be between {low:g} and {high:g}, got {value:g}")
    return float(value)


def _integer(data: dict, key: str, low: int | None, high: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key} must be an integer")
    if low is not None and value < low:
        raise invalid(f"{key} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise invalid(f"{key} must be at most {high}, got {value}")
    return value


def _boolean(data: dict, key: str, name: str | None = None) -> bool | None:
    value = data.get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{name or key} must be true or false")
    return value


def _object(data: dict, key: str, name: str | None = None) -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{name or key} must be an object")
    return value


def _string(data: dict, key: str, name: str, required: bool = False) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string")
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop must be a string or an array of strings")
    if len(value) > MAX_STOP:
        raise invalid(f"stop has {len(value)} strings; at most {MAX_STOP} are allowed")
    return tuple(s for s in value if s)


def _strings(data: dict, option: processors.Field) -> tuple[str, ...] | None:
    value = data.get(option.name)
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) > option.high
            or not all(isinstance(s, str) and 0 < len(s) <= option.longest for s in value)):
        raise invalid(f"{option.name} must be an array of at most {option.high:g} strings of 1 to {option.longest} characters")
    return tuple(value)


def _logit_bias(data: dict, option: processors.Field, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as (id, bias) pairs, ids in the tokenizer's range."""
    pairs = []
    for key, value in _object(data, option.name).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise invalid(f"{option.name} key {key[:20]!r} must be a token id from 0 to {vocab_size - 1}, as a string")
        bias = _number({key: value}, key, option.low, option.high, f"{option.name}[{key!r}]")
        pairs.append((int(key), bias))
    return tuple(pairs)


def _prompt(value, vocab_size: int) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # one prompt in a list, as some clients send it
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t < vocab_size for t in value):
            raise invalid(f"prompt token ids must be from 0 to {vocab_size - 1}")
        return value
    raise invalid("prompt must be a string or a non-empty array of token ids (one prompt per request)")


# ---- messages ---------------------------------------------------------------------


def _messages(value, max_messages: int) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array")
    if len(value) > max_messages:
        raise invalid(f"messages has {len(value)} entries; at most {max_messages} are allowed")
    messages: list[dict] = []
    for i, raw in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"{where} must be an object")
        role = raw.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}")
        if role == "developer":
            role = "system"
        message = {"role": role, "content": _content(raw, where, nullable=role == "assistant")}
        if (name := _string(raw, "name", f"{where}.name")) is not None:
            message["name"] = name
        if thought := _thought(raw, where, role):
            message["reasoning_content"] = thought
        if raw.get("function_call") is not None:
            if role != "assistant":
                raise invalid(f"{where}.function_call is only allowed on assistant messages")
            message["function_call"] = _call(raw["function_call"], f"{where}.function_call")
        if raw.get("tool_calls") is not None:
            if role != "assistant":
                raise invalid(f"{where}.tool_calls is only allowed on assistant messages")
            message["tool_calls"] = _tool_calls(raw["tool_calls"], f"{where}.tool_calls")
        if role in ("function", "tool"):
            _check_result(message, raw, messages, where)
        messages.append(message)
    if not any(m["role"] == "user" for m in messages):
        raise invalid("Expecting at least one user message.")
    return messages


def _content(raw: dict, where: str, nullable: bool) -> str:
    """Text of a message: a string, or an array of text parts (newer OpenAI clients)."""
    value = raw.get("content")
    if value is None and nullable:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}] must be a text part: {{\"type\": \"text\", \"text\": ...}}")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content must be a string")


def _thought(raw: dict, where: str, role: str) -> str:
    """An assistant message's earlier thinking: reasoning_content, or vLLM's newer name reasoning."""
    texts = [text for key in ("reasoning_content", "reasoning") if (text := _string(raw, key, f"{where}.{key}"))]
    if texts and role != "assistant":
        raise invalid(f"{where}: reasoning_content is only allowed on assistant messages")
    return texts[0] if texts else ""


def _prediction(value) -> str:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}."""
    if value is None:
        return ""
    if not isinstance(value, dict) or value.get("type") != "content":
        raise invalid('prediction must be {"type": "content", "content": ...}')
    return _content(value, "prediction", nullable=False)


def _call(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object")
    name = _string(value, "name", f"{where}.name", required=True)
    arguments = _string(value, "arguments", f"{where}.arguments")
    return {"name": name, "arguments": "{}" if arguments is None else arguments}


def _tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid(f"{where} must be a non-empty array")
    calls = []
    for j, raw in enumerate(value):
        here = f"{where}[{j}]"
        if not isinstance(raw, dict):
            raise invalid(f"{here} must be an object")
        if raw.get("type", "function") != "function":
            raise invalid(f"{here}.type must be \"function\"")
        call_id = _string(raw, "id", f"{here}.id", required=True)
        calls.append({"id": call_id, "type": "function", "function": _call(raw.get("function"), f"{here}.function")})
    return calls


def _check_result(message: dict, raw: dict, earlier: list[dict], where: str) -> None:
    """A function or tool result must answer a call the assistant just made."""
    caller = next((m for m in reversed(earlier) if m["role"] not in ("function", "tool")), None)
    if caller is None or not (caller.get("function_call") or caller.get("tool_calls")):
        raise invalid(f"{where}: a {message['role']} message must follow an assistant message that calls a function")
    if message["role"] == "tool":
        call_id = _string(raw, "tool_call_id", f"{where}.tool_call_id", required=True)
        ids = [call["id"] for call in caller.get("tool_calls") or ()]
        if ids and call_id not in ids:
            raise invalid(f"{where}.tool_call_id {call_id!r} matches no tool call of the preceding assistant message")
        message["tool_call_id"] = call_id


# ---- functions and tools ----------------------------------------------------------


def _functions(data: dict) -> tuple[list[dict], str | None, Choice]:
    """The offered functions, the reply style, and which call (if any) is forced."""
    if data.get("functions") is not None and data.get("tools") is not None:
        raise invalid("give either functions or tools, not both")
    if data.get("tools") is not None:
        tools = data["tools"]
        if not isinstance(tools, list):
            raise invalid("tools must be an array")
        functions = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise invalid(f"tools[{i}] must be an object with type \"function\"")
            functions.append(_definition(tool.get("function"), f"tools[{i}].function"))
        choice = _tool_choice(data.get("tool_choice"), functions)
        return functions, "tools" if functions else None, choice
    functions = data.get("functions")
    if functions is None:
        functions = []
    if not isinstance(functions, list):
        raise invalid("functions must be an array")
    functions = [_definition(f, f"functions[{i}]") for i, f in enumerate(functions)]
    choice = _function_call(data.get("function_call"), functions)
    if data.get("tool_choice") is not None and not functions:
        choice = _tool_choice(data["tool_choice"], functions)
    return functions, "functions" if functions else None, choice


def _definition(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object")
    name = _string(value, "name", f"{where}.name", required=True)
    if not FUNCTION_NAME.match(name):
        raise invalid(f"{where}.name must be 1-64 letters, digits, underscores or dashes")
    definition = {"name": name}
    if (description := _string(value, "description", f"{where}.description")) is not None:
        definition["description"] = description
    if value.get("parameters") is not None:
        definition["parameters"] = _schema(value, "parameters", f"{where}.parameters ({name})")
    return definition


def _schema(data: dict, key: str, name: str) -> dict:
    """A JSON schema the grammar can enforce."""
    schema = _object(data, key, name)
    if error := schema_error(schema):
        raise invalid(f"{name} is not a JSON schema tornchat can enforce: {error}")
    return schema


def _response_format(value) -> Format:
    if value is None:
        return Format()
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}')
    if value["type"] != "json_schema":
        return Format(value["type"])
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema must be an object with name and schema")
    name = _string(spec, "name", "response_format.json_schema.name", required=True)
    if not FUNCTION_NAME.match(name):
        raise invalid("response_format.json_schema.name must be 1-64 letters, digits, underscores or dashes")
    _boolean(spec, "strict", "response_format.json_schema.strict")  # always enforced: the grammar allows nothing else
    _string(spec, "description", "response_format.json_schema.description")
    if spec.get("schema") is None:
        raise invalid("response_format.json_schema.schema is required")
    return Format("json_schema", _schema(spec, "schema", "response_format.json_schema.schema"), name)


def _function_call(value, functions: list[dict]) -> Choice:
    if value is None or value == "auto":
        return Choice("auto")
    if value == "none":
        return Choice("none")
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return _named(value["name"], functions, "function_call.name", "functions")
    raise invalid('function_call must be "auto", "none" or {"name": ...}')


def _tool_choice(value, functions: list[dict]) -> Choice:
    if value is None or value == "auto":
        return Choice("auto")
    if value in ("none", "required"):
        if value == "required" and not functions:
            raise invalid('tool_choice "required" needs tools')
        return Choice(value)
    if isinstance(value, dict) and isinstance(value.get("function"), dict) and isinstance(value["function"].get("name"), str):
        return _named(value["function"]["name"], functions, "tool_choice.function.name", "tools")
    raise invalid('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')


def _named(name: str, functions: list[dict], where: str, offered_in: str) -> Choice:
    if name not in {f["name"] for f in functions}:
        raise invalid(f"{where} {name!r} is not one of the {offered_in} given")
    return Choice("named", name)
