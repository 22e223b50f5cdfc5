"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, what Claude Code speaks).

Against the real server and the embedded SmolLM2, through the official
``anthropic`` SDK (``messages.create``, ``messages.stream``,
``messages.count_tokens``) and raw HTTP where the framing, the event order
or a bad body is under test. This SDK no longer sends sampling fields
itself; greedy requests pass ``temperature`` in ``extra_body``, as a
client of a local server does. Replies are kept to a few tokens.
"""
import json
import re

import anthropic
import pytest

from bench import servers
from tornchat import MODEL_ID

GREEDY_BODY = {"temperature": 0}
COLORS = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"model": "any-model", "max_tokens": 8, "messages": COLORS}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"model": "m", "max_tokens": 30, "messages": ASK_WEATHER, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.fixture(scope="module")
def claude(server):
    """The official Anthropic SDK on the module's server (it appends /v1/messages to the base URL)."""
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def post(server, body, path="/v1/messages", headers=None) -> servers.Reply:
    return servers.request(server.url, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


def events(server, body: dict, path="/v1/messages?beta=true") -> list[tuple[str, dict]]:
    conn = servers.connect(server.url)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        return list(servers.sse_events(response))
    finally:
        conn.close()


@pytest.fixture(scope="module")
def reference(claude):
    return claude.messages.create(**GREEDY, extra_body=GREEDY_BODY)


@pytest.fixture(scope="module")
def forced(claude):
    return claude.messages.create(**FORCED, extra_body=GREEDY_BODY)


# ---- replies ----------------------------------------------------------------------


def test_reply_shape(reference):
    assert reference.id.startswith("msg_") and reference.type == "message" and reference.role == "assistant"
    assert reference.model == MODEL_ID
    [block] = reference.content
    assert block.type == "text" and block.text
    assert reference.stop_reason in ("end_turn", "max_tokens") and reference.stop_sequence is None
    assert reference.usage.output_tokens <= 8
    assert (reference.stop_reason == "max_tokens") == (reference.usage.output_tokens == 8)


def test_greedy_text_equals_chat_completions(client, reference):
    # One answer per request (DESIGN): the same conversation renders to the same prompt on both paths.
    chat = client.chat.completions.create(model="m", messages=COLORS, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == reference.content[0].text
    usage = reference.usage
    assert chat.usage.prompt_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_count_tokens_is_the_prompt_a_message_would_have(claude, reference):
    counted = claude.messages.count_tokens(model="m", messages=COLORS)
    assert counted.input_tokens == reference.usage.input_tokens + reference.usage.cache_read_input_tokens
    with_tools = claude.messages.count_tokens(model="m", messages=COLORS, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_stream_events_in_order_and_text_equal_the_plain_reply(server, reference):
    records = events(server, {**GREEDY, **GREEDY_BODY})
    for name, data in records:
        assert data["type"] == name
    names = [name for name, _ in records]
    deltas = [data["delta"]["text"] for name, data in records if name == "content_block_delta"]
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    start = records[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == MODEL_ID
    usage = reference.usage
    assert start["usage"]["input_tokens"] == usage.input_tokens + usage.cache_read_input_tokens
    assert records[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(deltas) == reference.content[0].text
    delta = records[-2][1]
    assert delta["delta"] == {"stop_reason": reference.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == reference.usage.output_tokens


def test_sdk_stream_accumulates_the_reply(claude, reference):
    with claude.messages.stream(**GREEDY, extra_body=GREEDY_BODY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == reference.content[0].text
    assert final.stop_reason == reference.stop_reason


def test_claude_code_fields_are_accepted_and_ignored(claude, server):
    # As Claude Code sends them: ?beta=true, system as blocks with cache_control (the first a billing header
    # for Anthropic, dropped), a system message inside messages, content as blocks, and fields that change nothing here.
    body = {
        "model": "m", "max_tokens": 1, "stream": False, "temperature": 0,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.331.233; cc_entrypoint=sdk-cli;"},
                   {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
        "context_management": {"edits": []}, "output_config": {"effort": "low"}, "betas": ["x"],
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    reply = post(server, body, "/v1/messages?beta=true", headers)
    assert reply.status == 200, reply.body
    as_string = post(server, {**body, "system": "You are terse.", "messages": [{"role": "user", "content": "Hi"}]})
    prompt = lambda r: r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"]  # noqa: E731
    assert prompt(reply) == prompt(as_string)
    inside = post(server, {**body, "system": None, "messages": [{"role": "system", "content": "You are terse."},
                                                                  {"role": "user", "content": "Hi"}]})
    assert inside.status == 200 and prompt(inside) == prompt(reply)


# ---- tool use ---------------------------------------------------------------------


def test_forced_tool_use_parses_against_its_schema(forced):
    [block] = forced.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) <= {"city"} and isinstance(block.input["city"], str)
    assert forced.stop_reason == "tool_use"


def test_tool_round_trip_reuses_the_kv_slot(claude, forced):
    block = forced.content[0]
    second = claude.messages.create(
        model="m", max_tokens=8, tools=[WEATHER], extra_body=GREEDY_BODY,
        messages=[*ASK_WEATHER, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C"}]}],
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    # The first turn's prompt is a prefix of the second's: the slot holds it, only what is new is prefilled.
    first_prompt = forced.usage.input_tokens + forced.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 4


def test_streamed_tool_use_has_json_deltas_and_a_block_stop(server, claude):
    records = events(server, {**FORCED, **GREEDY_BODY, "tool_choice": {"type": "any"}})
    names = [name for name, _ in records]
    start = records[2][1]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in records if n == "content_block_delta")
    assert json.loads(partial)["city"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert records[-2][1]["delta"]["stop_reason"] == "tool_use"
    with claude.messages.stream(**FORCED, extra_body=GREEDY_BODY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and isinstance(final.content[0].input["city"], str)


# ---- errors and credentials -----------------------------------------------------------

INVALID = [
    ({"max_tokens": 8, "messages": COLORS}, "model"),
    ({"model": "m", "messages": COLORS}, "max_tokens"),
    ({**GREEDY, "messages": []}, "messages must be"),
    ({**GREEDY, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({**GREEDY, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**GREEDY, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({**GREEDY, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({**GREEDY, "messages": [{"role": "assistant", "content": "hi"}]}, "user message"),
    ({**GREEDY, "system": 3}, "system"),
    ({**GREEDY, "tools": [{**WEATHER, "input_schema": {"type": "object", "properties": 3}}]}, "tools[0].input_schema (get_weather)"),
    ({**GREEDY, "tools": [{"input_schema": WEATHER_SCHEMA}]}, "tools[0].name"),
    ({**GREEDY, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({**GREEDY, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({**GREEDY, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({**GREEDY, "stop_sequences": "a"}, "stop_sequences"),
    ({**GREEDY, "temperature": 3}, "temperature"),
    ({**GREEDY, "top_k": 0}, "top_k"),
]


@pytest.mark.parametrize("body, field", INVALID, ids=[f"{i}-{case[1][:30]}" for i, case in enumerate(INVALID)])
def test_invalid_fields_are_400_naming_them_in_anthropic_shape(server, body, field):
    reply = post(server, body)
    assert reply.status == 400, reply.body
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"], body


def test_count_tokens_validates_like_messages(server):
    reply = post(server, {"model": "m", "messages": [{"role": "user", "content": 3}]}, "/v1/messages/count_tokens")
    assert reply.status == 400 and "messages[0].content" in reply.json()["error"]["message"]


def test_prompt_longer_than_the_context_is_anthropics_prompt_too_long(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hello " * 9000}])
    message = caught.value.body["error"]["message"]
    # Anthropic's wording, which Claude Code recognises; and ours, naming the prompt's tokens and the context.
    assert re.match(r"prompt is too long: \d+ tokens > 8191 maximum", message), message
    assert "context of 8192 tokens" in message


def test_x_api_key_is_accepted_and_401_is_anthropic_shaped():
    with servers.running("--api-key", "sekrit") as server:
        body = {**GREEDY, "max_tokens": 1}
        assert post(server, body, headers={"x-api-key": "sekrit"}).status == 200
        assert post(server, body, headers={"Authorization": "Bearer sekrit"}).status == 200
        for headers in ({}, {"x-api-key": "wrong"}):
            reply = post(server, body, headers=headers)
            assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
        denied = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            denied.messages.count_tokens(model="m", messages=COLORS)
        claude = anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)
        assert claude.messages.count_tokens(model="m", messages=COLORS).input_tokens > 0
        # The Responses API keeps to OpenAI's header and error shape.
        responses = servers.request(server.url, "POST", "/v1/responses", {"model": "m", "input": "hi"}, {"x-api-key": "sekrit"})
        assert responses.status == 401 and responses.json()["error"]["message"] == "Invalid or missing credentials"


def test_live_replies_match_the_documented_schemas(server, reference, forced):
    from jsonschema import Draft202012Validator

    document = servers.request(server.url, "GET", "/openapi.json").json()

    def check(name: str, value: dict) -> None:
        Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]}).validate(value)

    for reply in (reference, forced):
        check("AnthropicMessage", reply.model_dump(mode="json", exclude_none=True))
    for body in ({**GREEDY, "max_tokens": 2}, {**FORCED, "tool_choice": {"type": "any"}}):
        for _, data in events(server, body):
            check("MessageStreamEvent", data)
    check("TokenCount", post(server, {"model": "m", "messages": COLORS}, "/v1/messages/count_tokens").json())
    check("AnthropicError", post(server, {"model": "m", "messages": COLORS}).json())
    check("MessagesRequest", FORCED)
