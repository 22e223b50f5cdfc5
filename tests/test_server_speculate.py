"""Speculation through the real server: --speculate, OpenAI's ``prediction`` field, the usage details and
the counters, with the official SDK; bad input is a 400 naming the field."""
import re

import pytest

from bench import servers

FUNCTION = '''def parse_line(line, sep=","):
    fields = [field.strip() for field in line.split(sep)]
    if not fields or not fields[0]:
        raise ValueError("empty line")
    name, *values = fields
    numbers = [float(value) for value in values if value]
    return {"name": name, "values": numbers, "total": sum(numbers)}
'''
EDIT = [{"role": "system", "content": "You are a careful programmer."},
        {"role": "user", "content": f"Rename `fields` to `parts` in this function. Reply with the function only.\n\n{FUNCTION}"}]


@pytest.fixture(scope="module")
def servers_on_off():
    with servers.running("--speculate", "lookup") as on, servers.running("--speculate", "none") as off:
        yield on, off


def client_of(server):
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=600)


def counters(server) -> dict[str, float]:
    text = servers.request(server.url, "GET", "/metrics").body.decode()
    return {name: float(value) for name, value in re.findall(r"^(tornchat_engine_\w+_total) (\S+)$", text, re.M)}


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_same_reply_with_speculation_on_and_off_and_the_details_in_usage(servers_on_off, extra):
    on, off = servers_on_off

    def reply(server, prediction: str):
        return client_of(server).chat.completions.create(
            model="m", messages=EDIT, max_tokens=120, prediction={"type": "content", "content": prediction}, **extra)

    before = counters(on)
    replies = [reply(on, FUNCTION), reply(off, FUNCTION)]
    after = counters(on)
    text = replies[0].choices[0].message.content
    assert text == replies[1].choices[0].message.content
    details = [r.usage.completion_tokens_details for r in replies]
    assert details[1].accepted_prediction_tokens == details[1].rejected_prediction_tokens == 0  # off
    drafted = details[0].accepted_prediction_tokens + details[0].rejected_prediction_tokens
    assert drafted > 0
    assert after["tornchat_engine_drafted_tokens_total"] - before["tornchat_engine_drafted_tokens_total"] == drafted
    assert (after["tornchat_engine_accepted_tokens_total"] - before["tornchat_engine_accepted_tokens_total"]
            == details[0].accepted_prediction_tokens)
    # The reply itself as the prediction: the same reply (its prompt now comes from the KV slot, and every row
    # gets the same bits however it arrives), its drafts accepted.
    again = reply(on, text)
    assert again.choices[0].message.content == text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_streamed_reply_is_the_plain_one_with_usage_details(servers_on_off):
    on, _ = servers_on_off
    client = client_of(on)
    plain = client.chat.completions.create(model="m", messages=EDIT, max_tokens=80, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=EDIT, max_tokens=80, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens >= 0


def test_prediction_as_text_parts_and_on_completions(servers_on_off):
    on, _ = servers_on_off
    client = client_of(on)
    parts = {"type": "content", "content": [{"type": "text", "text": FUNCTION[:100]}, {"type": "text", "text": FUNCTION[100:]}]}
    reply = client.chat.completions.create(model="m", messages=EDIT, max_tokens=60, temperature=0, prediction=parts)
    assert reply.usage.completion_tokens_details.accepted_prediction_tokens > 0
    # The completion's own greedy text as the prediction: the same text again, its drafts accepted.
    body = {"model": "m", "prompt": FUNCTION + "\n" + FUNCTION[:40], "max_tokens": 30, "temperature": 0}
    plain = servers.request(on.url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    predicted = servers.request(on.url, "POST", "/v1/completions", {
        **body, "prediction": {"type": "content", "content": plain.json()["choices"][0]["text"]}},
        {"Content-Type": "application/json"})
    assert predicted.status == 200
    assert predicted.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert predicted.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize("prediction", ["def f(): pass", {"type": "text", "content": "x"}, {"type": "content", "content": 3},
                                        {"type": "content", "content": [{"type": "image_url"}]}])
def test_bad_prediction_is_a_400_naming_it(servers_on_off, prediction):
    reply = servers.request(servers_on_off[0].url, "POST", "/v1/chat/completions",
                            {"model": "m", "messages": EDIT, "prediction": prediction}, {"Content-Type": "application/json"})
    assert reply.status == 400
    assert "prediction" in reply.json()["detail"]


def test_the_log_says_what_speculation_costs_here(servers_on_off):
    on, off = servers_on_off
    assert re.search(r"speculation on: a verify of 1\.\.8 rows costs \[1\.0, ", on.log())
    assert "speculation" not in off.log() and "Traceback" not in on.log() + off.log()
