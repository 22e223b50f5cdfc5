"""The chat page's structured-output pieces: the response_format schema box and the token-probability view.

They use the structured-output request fields (docs/api.md: response_format
json_schema; logprobs / top_logprobs answered in choices[].logprobs.content[]
with token, logprob, bytes, top_logprobs).
"""
import json

import jsonschema
import pytest

import browser
from bench import servers

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    with servers.running("--quantize", "none") as running:
        yield running


def sent_bodies(tab) -> list[dict]:
    bodies = []
    tab.page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(json.loads(r.post_data)))
    return bodies


def stored_reply(tab) -> dict:
    conversations = json.loads(tab.page.evaluate("localStorage.getItem('tornchat.conversations')"))
    return conversations[0]["messages"][-1]


def test_schema_box_constrains_the_reply(chromium, server):
    with browser.tab(chromium, server.url) as tab:
        bodies = sent_bodies(tab)
        tab.setting("schema", "{not json")
        assert "The JSON schema is not valid JSON" in tab.page.inner_text("#settings-error")
        tab.send("Where is the Eiffel Tower?")
        assert "The JSON schema is not valid JSON" in tab.page.inner_text("#error") and bodies == []

        tab.setting("schema", json.dumps(SCHEMA))
        assert tab.page.is_hidden("#settings-error")
        tab.setting("temperature", "0")
        tab.setting("max_tokens", "60")
        tab.page.click("#send")
        tab.wait_idle()
        assert bodies[-1]["response_format"] == {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
        reply = stored_reply(tab)
        assert reply["stats"]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["content"]), SCHEMA)
        assert tab.errors == []


def test_token_probabilities_view(chromium, server):
    with browser.tab(chromium, server.url) as tab:
        bodies = sent_bodies(tab)
        page = tab.page
        tab.setting("temperature", "0")
        tab.setting("max_tokens", "12")
        page.check("#s-logprobs")
        tab.send("Name three colours.")
        tab.wait_idle()
        assert bodies[-1]["logprobs"] is True and bodies[-1]["top_logprobs"] == 5
        reply = stored_reply(tab)
        entries = reply["logprobs"]
        assert len(entries) == 12 and all(e["logprob"] <= 0 for e in entries)
        assert "".join(e["token"] for e in entries).startswith(reply["content"])

        tab.reply().locator(".toggle-tokens").click()
        tokens = tab.reply().locator(".tokens .token")
        assert tokens.count() == len(entries)
        assert tokens.all_inner_texts() == [e["token"] for e in entries]
        tokens.first.click()
        detail = tab.reply().locator(".token-detail")
        assert detail.is_visible()
        assert detail.locator("li").count() == 5
        # Greedy decoding took the most likely token, so it heads the alternatives.
        assert detail.locator("li").first.get_attribute("class") == "chosen"
        tab.reply().locator(".toggle-tokens").click()
        assert tab.reply().locator(".tokens").count() == 0
        assert tab.errors == []
