"""Bad input against the real server process: the OpenAPI document, a fuzz run, the size limits.

The fuzz run posts hypothesis-generated bodies: bodies drawn from the
request schema that /openapi.json publishes (so mostly well-typed, often
still wrong in meaning), those with one field swapped for arbitrary JSON,
arbitrary JSON, and raw bytes. Whatever arrives, the answer is a 200 that
matches the documented reply schema or a 4xx with a ``detail`` that leaks
nothing, within a timeout.
"""
import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from bench import servers
from tornchat.server.app import ROUTES

MAX_BODY, MAX_MESSAGES = 65536, 8
ASK = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
CONTINUE = {"model": "m", "prompt": "Say hi.", "max_tokens": 2}
# Each generating endpoint, its request schema and its reply schemas (whole, streamed chunk).
ENDPOINTS = {
    "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
    "/v1/completions": ("CompletionRequest", "Completion", "Completion"),
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    flags = ("--checkpoint-path", tiny_checkpoint, "--max-body-bytes", str(MAX_BODY), "--max-messages", str(MAX_MESSAGES))
    with servers.running(*flags) as running:
        running.checkpoint = tiny_checkpoint
        yield running


@pytest.fixture(scope="module")
def document(server) -> dict:
    reply = servers.request(server.url, "GET", "/openapi.json")
    assert reply.status == 200 and reply.headers["Content-Type"] == "application/json"
    return reply.json()


def validator(document: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]})


def post(server, body, path="/v1/chat/completions") -> servers.Reply:
    return servers.request(server.url, "POST", path, body, {"Content-Type": "application/json"})


def stream_chunks(server, body: dict, path="/v1/chat/completions") -> list[dict]:
    conn = servers.connect(server.url, timeout=60)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        response = conn.getresponse()
        assert response.status == 200
        records = list(servers.sse_data(response))
    finally:
        conn.close()
    assert records[-1] == "[DONE]"
    return [json.loads(r) for r in records[:-1]]


def assert_clean_error(server, reply: servers.Reply, sent: bytes = b"") -> None:
    """A 4xx with one detail, naming nothing of the server's insides (a traceback, a path, the model's modules):
    the words the request itself sent, which an error may quote back (a tool named "LLAMA"), aside."""
    assert 400 <= reply.status < 500, (reply.status, reply.body[:300])
    body = reply.json()
    assert list(body) == ["detail"] and isinstance(body["detail"], str)
    if reply.status == 400:
        assert body["detail"].startswith("Invalid request: ")
    text, quoted = reply.body.decode(), sent.decode(errors="replace").lower()
    assert server.checkpoint not in text and "tiny-checkpoint" not in text
    assert "Traceback" not in text and 'File "' not in text
    assert "llama" not in text.lower() or "llama" in quoted


# ---- the document -----------------------------------------------------------------


def test_every_route_is_documented(document):
    assert document["openapi"].startswith("3.")
    template = re.compile(r"\(.*?\)|\{.*?\}")
    documented = {template.sub("{}", path) for path in document["paths"]}
    assert {template.sub("{}", path) for path, _ in ROUTES} == documented
    for name, schema in document["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
    assert document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == MAX_MESSAGES


def test_live_replies_match_the_documented_schemas(server, document):
    validator(document, "ModelList").validate(servers.request(server.url, "GET", "/v1/models").json())
    validator(document, "Model").validate(servers.request(server.url, "GET", "/v1/models/gpt-3.5-turbo").json())
    validator(document, "Health").validate(server.health())
    validator(document, "ChatCompletion").validate(post(server, ASK).json())
    chunks = stream_chunks(server, {**ASK, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        validator(document, "ChatCompletionChunk").validate(chunk)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    forced = {**ASK, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    validator(document, "ChatCompletion").validate(post(server, forced).json())
    with_logprobs = {**ASK, "logprobs": True, "top_logprobs": 3, "presence_penalty": 1, "logit_bias": {"5": -100}, "min_p": 0.1}
    reply = post(server, with_logprobs).json()
    validator(document, "ChatCompletion").validate(reply)
    assert len(reply["choices"][0]["logprobs"]["content"]) == reply["usage"]["completion_tokens"]
    # Sampled at temperature 1 without a seed, a reply may end early on the stop token: one logprob per token
    # the usage counts, not a fixed number.
    chunks = stream_chunks(server, {**with_logprobs, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        validator(document, "ChatCompletionChunk").validate(chunk)
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert sum(len(c["choices"][0].get("logprobs", {}).get("content", [])) for c in chunks if c["choices"]) == usage["completion_tokens"] > 0
    for body in (CONTINUE, {**CONTINUE, "logprobs": 2, "repetition_penalty": 1.2}):
        reply = post(server, body, "/v1/completions").json()
        validator(document, "Completion").validate(reply)
        assert (reply["choices"][0]["logprobs"] is None) == ("logprobs" not in body)
        for chunk in stream_chunks(server, {**body, "stream_options": {"include_usage": True}}, "/v1/completions"):
            validator(document, "Completion").validate(chunk)
    for reply in (post(server, {}), servers.request(server.url, "GET", "/nowhere")):
        validator(document, "Error").validate(reply.json())


# ---- fuzz -------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values that satisfy schema, for the keywords openapi.py uses."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, components) for k in kind])
    if kind == "string":
        return st.from_regex(schema["pattern"], fullmatch=True) if "pattern" in schema else st.text(min_size=schema.get("minLength", 0), max_size=30)
    if kind == "integer":
        low = schema.get("minimum", -(2**64))
        return st.integers(low, schema.get("maximum", low + 2**65))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 3))
    if kind == "object" and "additionalProperties" in schema:
        keys = st.from_regex(schema["propertyNames"]["pattern"], fullmatch=True) if "propertyNames" in schema else st.text(max_size=10)
        return st.dictionaries(keys, from_schema(schema["additionalProperties"], components), max_size=3)
    if kind == "object" and "properties" in schema:
        properties = {name: from_schema(s, components) for name, s in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required}, optional={k: v for k, v in properties.items() if k not in required}
        )
    return JSON


def bodies(document: dict, name: str) -> st.SearchStrategy:
    components = document["components"]["schemas"]
    request = dict(components[name])
    # Keep accepted requests to a few tokens: every one runs on the model.
    short = {"type": "integer", "minimum": 1, "maximum": 4}
    request["properties"] = {**request["properties"], "max_tokens": short}
    request["required"] = [*request["required"], "max_tokens"]
    documented = from_schema(request, components)
    # Most documented bodies still break a rule the schema cannot say (a user
    # message, calls before results, token ids within the vocabulary,
    # top_logprobs only with logprobs, ...); these plain ones are accepted.
    chat = {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "user"}, "content": {"type": "string"}}}
    unsaid = ("functions", "function_call", "tools", "tool_choice", "logit_bias", "top_logprobs")
    plain = {k: v for k, v in request["properties"].items() if k not in unsaid}
    if "messages" in plain:
        plain["messages"] = {"type": "array", "minItems": 1, "maxItems": 3, "items": chat}
    else:
        plain["prompt"] = {"type": "string", "minLength": 1}
    accepted = from_schema({**request, "properties": plain}, components)
    one_field_wrong = st.tuples(documented, st.sampled_from(sorted(request["properties"])), JSON).map(
        lambda t: {**t[0], t[1]: t[2], "max_tokens": 2} if t[1] != "max_tokens" else {**t[0], t[1]: t[2]}
    )
    return st.one_of(
        accepted.map(lambda b: json.dumps(b).encode()),
        documented.map(lambda b: json.dumps(b).encode()),
        one_field_wrong.map(lambda b: json.dumps(b).encode()),
        JSON.map(lambda b: json.dumps(b).encode()),
        st.binary(max_size=200),
    )


EDGE_CASES = [
    b"[" * 5000 + b"]" * 5000,  # nested past the parser's depth
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',  # lone surrogate
    b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}',  # not UTF-8
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 40 + b"}",
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": -99999999999999999999}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_k": 2147483648}',  # past int32
    b'{"model": "m", "model": 1, "messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 2}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"1' + b"0" * 40 + b'": 1}}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"\xd9\xa3": 1}}',  # a non-ASCII digit
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": true, "top_logprobs": 1' + b"0" * 30 + b"}",
    b'{"model": "m", "messages": [{"role": "developer", "content": null}, {"role": "user", "content": "hi"}], "max_tokens": 1}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1, "min_p": 1, "repetition_penalty": 1e-300}',
]


def check(server, document: dict, raw: bytes, path: str = "/v1/chat/completions") -> int:
    _, whole, chunk_schema = ENDPOINTS[path]
    reply = post(server, raw, path)
    if reply.status != 200:
        assert_clean_error(server, reply, raw)
        return reply.status
    body = json.loads(raw)
    if body.get("stream") is True:
        for chunk in stream_chunks(server, body, path):
            assert "error" not in chunk, chunk
            validator(document, chunk_schema).validate(chunk)
    else:
        validator(document, whole).validate(reply.json())
    return 200


@pytest.mark.parametrize("raw", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_edge_case_bodies(server, document, raw):
    check(server, document, raw)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_bodies_get_a_reply_or_a_clean_4xx(server, document, path):
    statuses = Counter()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bodies(document, ENDPOINTS[path][0]))
    def run(raw):
        statuses[check(server, document, raw, path)] += 1

    run()
    print(statuses)
    assert statuses[200] >= 5 and statuses[400] >= 50, "both accepted and rejected bodies were exercised"
    health = server.health()
    assert health["server"]["http_server_errors"] == 0 and health["engine"]["failed"] == 0
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


# ---- limits -----------------------------------------------------------------------


def test_prompt_longer_than_the_context_is_400(server):
    # The tiny model's context is 4096 tokens; this prompt has more, in far fewer bytes than the body limit.
    reply = post(server, {**ASK, "messages": [{"role": "user", "content": "hello " * 5000}]})
    assert_clean_error(server, reply)
    assert reply.status == 400 and "context of 4096 tokens" in reply.json()["detail"]


def test_body_and_message_limits_are_clean_4xx(server):
    too_big = post(server, {**ASK, "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
    assert too_big.status == 413 and "max_body_bytes" in too_big.json()["detail"]
    too_many = post(server, {**ASK, "messages": ASK["messages"] * (MAX_MESSAGES + 1)})
    assert too_many.status == 400 and f"at most {MAX_MESSAGES}" in too_many.json()["detail"]
    for reply in (too_big, too_many):
        assert_clean_error(server, reply)
