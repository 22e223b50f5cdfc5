"""Structured outputs and forced calls through the real server, the embedded SmolLM2 and the OpenAI SDK.

Every reply must parse and validate against its schema: the grammar allows
nothing else. Schemas bound their strings and arrays so that a reply fits in
the few tokens each test can afford on a 2-core machine.
"""
import json
from typing import Literal

import jsonschema
import pydantic
import pytest

from bench import servers

ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperatures": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "maxItems": 3},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "temperatures", "sunny"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": False,
    },
}
ALARM = {
    "name": "set_alarm",
    "description": "Set an alarm",
    "parameters": {
        "type": "object",
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "weekdays": {"type": "boolean"}},
        "required": ["hour", "weekdays"],
        "additionalProperties": False,
    },
}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ALARM)}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ALARM)]


def streamed(client, **request) -> tuple[str, list[dict], str]:
    """Content, calls ({name, arguments}) and finish_reason, joined from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- response_format --------------------------------------------------------------


def test_json_schema_reply_validates_and_streams_the_same(client):
    request = dict(
        model="m", messages=ASK, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}},
    )
    client.chat.completions.create(**request)  # leaves the prompt in a KV slot, which the next two both reuse
    reply = client.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), FORECAST)
    assert streamed(client, **request) == (reply.message.content, [], "stop")


def test_json_object_reply_is_one_object(client):
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a cat as JSON."}], temperature=0, max_tokens=60,
        response_format={"type": "json_object"},
    ).choices[0]
    assert reply.message.content.startswith("{") and "\n" not in reply.message.content
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)


def test_text_format_is_plain_text(client):
    request = dict(model="m", messages=ASK, temperature=0, max_tokens=6)
    plain = client.chat.completions.create(**request)
    text = client.chat.completions.create(**request, response_format={"type": "text"})
    assert text.usage.prompt_tokens == plain.usage.prompt_tokens, "nothing added to the prompt"
    assert text.choices[0].message.content and not text.choices[0].message.content.startswith("{")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=30)


def test_sdk_parse_with_a_pydantic_model(client):
    """client.chat.completions.parse sends a strict json_schema and parses the reply into the model."""
    reply = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Invent a pet."}], temperature=1.0, seed=3, max_tokens=40,
        response_format=Pet,
    )
    pet = reply.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "bird")


# ---- function calls ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_tool_call_validates_and_streams_the_same(client, temperature):
    request = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=temperature, seed=5, max_tokens=60)
    client.chat.completions.create(**request)  # as above: plain and streamed find the same KV slot
    reply = client.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls = [{"name": call.function.name, "arguments": call.function.arguments}]
    assert streamed(client, **request) == ("", calls, "tool_calls")


def test_named_legacy_function_call_validates(client):
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Wake me at seven."}], functions=[WEATHER, ALARM],
        function_call={"name": "set_alarm"}, temperature=1.0, seed=1, max_tokens=40,
    ).choices[0]
    assert reply.finish_reason == "function_call" and reply.message.function_call.name == "set_alarm"
    jsonschema.validate(json.loads(reply.message.function_call.arguments), ALARM["parameters"])


def test_named_tool_call_with_json_schema_format_still_calls(client):
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}},
        temperature=0, max_tokens=60,
    ).choices[0]
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])


# ---- schemas that cannot be enforced ----------------------------------------------


def post(server, body) -> servers.Reply:
    return servers.request(server.url, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"response_format": {"type": "xml"}}, "response_format must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": FORECAST}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema is required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema.schema is not a JSON schema tornchat can enforce: Invalid type: foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}}},
            "response_format.json_schema.schema is not a JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}]},
            "tools[0].function.parameters (f) is not a JSON schema tornchat can enforce",
        ),
        ({"functions": [{"name": "g", "parameters": {"type": ["object", 3]}}]}, "functions[0].parameters (g)"),
    ],
)
def test_unusable_schema_is_400_naming_the_field(server, extra, field):
    reply = post(server, {"model": "m", "messages": ASK, "max_tokens": 4, **extra})
    assert reply.status == 400, reply.body
    assert reply.json()["detail"].startswith("Invalid request: " + field), reply.json()["detail"]


def test_server_logged_no_tracebacks(server):
    assert "Traceback" not in server.log()
