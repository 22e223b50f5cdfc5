"""POST /v1/responses (OpenAI's Responses API, what Codex CLI speaks) against the real server and the embedded SmolLM2.

Through the official OpenAI SDK (``responses.create``, ``responses.stream``)
where a client would use it, and raw HTTP where the framing, the event
order or a bad body is under test. Replies are kept to a few tokens.
"""
import json
import re

import jsonschema
import openai
import pytest

from bench import servers
from tornchat import MODEL_ID

STORE = 3  # --responses-store: small, so that the test of its bound is cheap
COLORS = "Name three colors."
GREEDY = {"model": "gpt-4o", "input": COLORS, "temperature": 0, "max_output_tokens": 8}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": False}
ASK_WEATHER = "What is the weather in Paris?"
FORCED = {
    "model": "gpt-4o", "input": ASK_WEATHER, "temperature": 0, "max_output_tokens": 30,
    # a tool type this server does not run comes along, as Codex sends them: ignored
    "tools": [WEATHER, {"type": "web_search"}], "tool_choice": {"type": "function", "name": "get_weather"},
}


@pytest.fixture(scope="module")
def server():
    with servers.running("--responses-store", str(STORE)) as running:
        yield running


def post(server, body, headers=None) -> servers.Reply:
    return servers.request(server.url, "POST", "/v1/responses", body, {"Content-Type": "application/json", **(headers or {})})


def events(server, body: dict) -> list[tuple[str, dict]]:
    conn = servers.connect(server.url)
    try:
        conn.request("POST", "/v1/responses", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        return list(servers.sse_events(response))
    finally:
        conn.close()


@pytest.fixture(scope="module")
def reference(client):
    return client.responses.create(**GREEDY)


@pytest.fixture(scope="module")
def forced(client):
    return client.responses.create(**FORCED)


# ---- replies ----------------------------------------------------------------------


def test_reply_shape(reference):
    assert reference.id.startswith("resp_") and reference.object == "response" and reference.model == MODEL_ID
    assert reference.status in ("completed", "incomplete") and reference.error is None
    [item] = reference.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and reference.output_text == item.content[0].text != ""
    usage = reference.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens <= 8
    if reference.status == "incomplete":
        assert usage.output_tokens == 8 and reference.incomplete_details.reason == "max_output_tokens"


def test_greedy_text_equals_chat_completions(client, reference):
    # One answer per request (DESIGN): the same conversation renders to the same prompt on both paths.
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": COLORS}], temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == reference.output_text
    assert chat.usage.prompt_tokens == reference.usage.input_tokens


def test_instructions_and_developer_messages_are_the_system_prompt(client):
    body = {**GREEDY, "max_output_tokens": 1}
    by_instructions = client.responses.create(**body, instructions="Be brief.")
    by_developer = client.responses.create(**{**body, "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": COLORS}], "id": "x", "status": "completed"},
    ]})
    assert by_instructions.usage.input_tokens == by_developer.usage.input_tokens
    assert by_instructions.output_text == by_developer.output_text


def test_stream_events_in_order_and_text_equal_the_plain_reply(server, reference):
    records = events(server, GREEDY)
    for name, data in records:
        assert data["type"] == name
    assert [data["sequence_number"] for _, data in records] == list(range(len(records)))
    names = [name for name, _ in records]
    deltas = [data["delta"] for name, data in records if name == "response.output_text.delta"]
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done", f"response.{reference.status}",
    ]
    assert "".join(deltas) == reference.output_text == records[-4][1]["text"]
    final = records[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == reference.output_text
    assert final["usage"]["output_tokens"] == reference.usage.output_tokens
    assert records[0][1]["response"]["id"] == final["id"] and records[0][1]["response"]["status"] == "in_progress"


def test_sdk_stream_accumulates_the_reply(client):
    with client.responses.stream(**{**GREEDY, "max_output_tokens": 200}) as stream:  # room to end: "completed"
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) != ""


# ---- function calls -----------------------------------------------------------------


def test_forced_tool_call_parses_against_its_schema(forced):
    [call] = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert forced.status == "completed"


def test_tool_round_trip_stateless_reuses_the_kv_slot(client, forced):
    call = forced.output[0]
    # As Codex sends a next turn: the whole history, items with extra id/status fields, a reasoning item without text (it adds nothing).
    second = client.responses.create(
        model="m", temperature=0, max_output_tokens=8, tools=[WEATHER],
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK_WEATHER}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments,
             "id": call.id, "status": "completed"},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
    )
    assert second.status in ("completed", "incomplete") and second.output
    # The first turn's prompt is a prefix of the second's: the slot holds it, only what is new is prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= forced.usage.input_tokens - 4


def test_previous_response_id_chains_the_same_conversation(client, forced):
    call = forced.output[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    chained = client.responses.create(model="m", temperature=0, max_output_tokens=1, tools=[WEATHER],
                                      previous_response_id=forced.id, input=[output])
    stateless = client.responses.create(
        model="m", temperature=0, max_output_tokens=1, tools=[WEATHER],
        input=[{"role": "user", "content": ASK_WEATHER},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, output],
    )
    assert chained.previous_response_id == forced.id
    assert chained.usage.input_tokens == stateless.usage.input_tokens
    assert chained.output_text == stateless.output_text


def test_streamed_required_call_has_argument_events(server):
    records = events(server, {**FORCED, "tool_choice": "required"})
    names = [name for name, _ in records]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert records[2][1]["item"]["type"] == "function_call" and records[2][1]["item"]["arguments"] == ""
    deltas = "".join(data["delta"] for name, data in records if name == "response.function_call_arguments.delta")
    [done] = [data for name, data in records if name == "response.function_call_arguments.done"]
    assert done["arguments"] == deltas and done["name"] == "get_weather"
    jsonschema.validate(json.loads(deltas), WEATHER_PARAMETERS)
    assert names[-2:] == ["response.output_item.done", "response.completed"]
    assert records[-1][1]["response"]["output"][0]["arguments"] == deltas


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 10}}, "required": ["color"],
              "additionalProperties": False}
    reply = client.responses.create(model="m", input="Name a color.", temperature=0, max_output_tokens=20,
                                    text={"format": {"type": "json_schema", "name": "color", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), schema)


# ---- the store behind previous_response_id -------------------------------------------


def test_store_keeps_the_last_responses_only(client):
    first = client.responses.create(**{**GREEDY, "max_output_tokens": 1})
    unstored = client.responses.create(**{**GREEDY, "max_output_tokens": 1}, store=False)
    for _ in range(STORE):
        client.responses.create(**{**GREEDY, "max_output_tokens": 1})
    for gone in (first.id, unstored.id):
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            client.responses.create(**{**GREEDY, "max_output_tokens": 1}, previous_response_id=gone)


# ---- errors -------------------------------------------------------------------------

INVALID = [
    ({"input": COLORS}, "model"),
    ({**GREEDY, "input": 3}, "input must be"),
    ({**GREEDY, "input": []}, "input must be"),
    ({**GREEDY, "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({**GREEDY, "input": [{"type": "computer_call"}]}, "input[0].type"),
    ({**GREEDY, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({**GREEDY, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({**GREEDY, "input": [{"role": "assistant", "content": "hi"}]}, "user message"),
    ({**GREEDY, "tools": [{**WEATHER, "parameters": {"type": "object", "properties": 3}}]}, "tools[0].parameters (get_weather)"),
    ({**GREEDY, "tools": [{**WEATHER, "name": "bad name!"}]}, "tools[0].name"),
    ({**GREEDY, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({**GREEDY, "tool_choice": "sometimes"}, "tool_choice"),
    ({**GREEDY, "text": {"format": {"type": "xml"}}}, "text.format"),
    ({**GREEDY, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({**GREEDY, "max_output_tokens": 0}, "max_output_tokens"),
    ({**GREEDY, "temperature": 3}, "temperature"),
    ({**GREEDY, "top_p": "high"}, "top_p"),
    ({**GREEDY, "previous_response_id": "resp_nothing"}, "previous_response_id"),
    ({**GREEDY, "truncation": "auto"}, "truncation"),
    ({**GREEDY, "background": True}, "background"),
    ({**GREEDY, "input": "hello " * 9000}, "context of 8192 tokens"),
]


@pytest.mark.parametrize("body, field", INVALID, ids=[f"{i}-{case[1][:30]}" for i, case in enumerate(INVALID)])
def test_invalid_fields_are_400_naming_them_in_openai_shape(server, body, field):
    reply = post(server, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_prompt_longer_than_the_context_names_tokens_and_context(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="hello " * 9000)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded"
    assert re.search(r"the prompt has \d+ tokens", error["message"]) and "context of 8192 tokens" in error["message"]


def test_body_that_is_not_json_is_400(server):
    reply = servers.request(server.url, "POST", "/v1/responses", b"{nope", {"Content-Type": "application/json"})
    assert reply.status == 400 and "not valid JSON" in reply.json()["error"]["message"]


def test_live_replies_match_the_documented_schemas(server, client, reference, forced):
    from jsonschema import Draft202012Validator

    document = servers.request(server.url, "GET", "/openapi.json").json()

    def check(name: str, value: dict) -> None:
        Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]}).validate(value)

    for reply in (reference, forced):
        check("Response", reply.model_dump(mode="json", exclude_none=True))
    for _, data in events(server, {**GREEDY, "max_output_tokens": 2}):
        check("ResponseStreamEvent", data)
    check("ResponsesError", post(server, {"input": COLORS}).json())
    check("ResponseRequest", FORCED)
